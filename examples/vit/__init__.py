"""The bundled Vision Transformer example: train, change the device count, restore_and_reshard, continue."""
