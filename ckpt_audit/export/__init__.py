"""Export: a checkpoint merged into a HuggingFace model directory, checked and put in place whole."""
