"""One module per screen: runs, checkpoints of a run, details of a checkpoint, and the modal dialogs."""
