"""The measurement lab: scripts, calibration and the scale model behind bench/lab/NOTEBOOK.md (not installed)."""
