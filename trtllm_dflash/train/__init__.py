"""Training DFlash drafts: target-regenerated data (`data`) and the block-diffusion trainer (`trainer`)."""
