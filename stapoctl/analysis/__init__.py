"""`stapoctl compare`: runs and sweeps read back from MLflow, tabulated over seeds and plotted.
Orchestration layer: it reads what trainer, eval and sweep wrote; nothing below imports it."""
