"""torch.distributed's data-parallel wrappers (DDP, FSDP2, FSDP1) around a step that runs a
tree in parts (:mod:`.sync`), the one gradient average treepack does itself, and every FSDP
internal it touches (:mod:`.compat`)."""
