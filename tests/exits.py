"""How a command-line script's `main(argv)` stops for many argument lists, all in one process.

A process per case spends seconds importing torch; one process runs every case. Each case's
exit status (0: main returned) and what it said (the SystemExit's text, then its standard
error, where argparse writes) come back in order. The command line's own exit, as a user
sees it, is left to one test per script that runs it for real. What a case prints on standard
output comes back too ("out": a --help).
"""

import json
import subprocess
import sys

_RUN = """
import contextlib, importlib.util, io, json, sys
spec = importlib.util.spec_from_file_location("cli_under_test", sys.argv[1])
sys.modules["cli_under_test"] = module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
results = []
for argv in json.loads(sys.argv[2]):
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            module.main(argv)
        status, text = 0, ""
    except SystemExit as exit:
        code = exit.code
        status, text = (0, "") if code in (None, 0) else (code, "") if isinstance(code, int) else (1, str(code))
    results.append(dict(status=status, text="\\n".join(t for t in (text, err.getvalue()) if t), out=out.getvalue()))
print(json.dumps(results))
"""


def exits(script, argvs: list[list[str]]) -> list[dict]:
    """[{"status": int, "text": str, "out": str}] for `script`'s main(argv) with each of `argvs` (in the worker's share of the
    cores: tests/conftest.py's OMP_NUM_THREADS)."""
    run = subprocess.run([sys.executable, "-c", _RUN, str(script), json.dumps([[str(a) for a in argv] for argv in argvs])],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.splitlines()[-1])
    assert len(results) == len(argvs)
    return results
