"""fmoe.train: see DESIGN.md; filled in by later work."""
