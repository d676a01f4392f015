"""MaxText fed by the loader and replayed by replay (docs/trainer.md, "MaxText")."""
