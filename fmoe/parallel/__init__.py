"""fmoe.parallel: see DESIGN.md; filled in by later work."""
