"""fmoe.optim: see DESIGN.md; filled in by later work."""
