"""fmoe.train: what a train loop needs besides the model and the optimizer.

    data        the embedded byte-level corpus (this Python's stdlib), text directories,
                token files, .npy arrays; packing into micro-batches with cu_seqlens; a
                resumable sampler; weighted blends of sources (load_blend, BlendSampler)
    prepare     python -m fmoe.train.prepare SRC OUT --tokenizer=tokenizer.json: text files
                -> a token file and its index (prompts and conversations: a loss mask too)
    chat        chat templates (a model folder's Jinja template, rendered as transformers
                does) and the assistant's character spans of a conversation
    checkpoint  torch.distributed.checkpoint saves that count only once complete; resume;
                retention; a run's own model back (run_config, load_run)
    metrics     FLOPs per token (SPEC.md 8), MFU, expert load, metrics.jsonl and progress,
                one host transfer per step (to_host), host-sync counting (HostReads)
    profile     torch.profiler over chosen steps (StepProfiler, phase), its traces and ops tables
    run         bit-reproducible runs (set_deterministic), config.json with versions and commit,
                stop requests: a signal or a time limit ends the run after a step (StopRequests)
    upcycle     a dense model's weights as the start of an MoE (upcycle_): the same function at step 0
    plot        python -m fmoe.train.plot <out_dir>: loss curves and expert-load heatmaps
"""
