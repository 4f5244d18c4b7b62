"""What an iteration costs before any job runs: its phases and what each needs on the device (`phases`, shared
with host offload and the out-of-memory back-off), its FLOPs (`flops`, shared with the measured MFU), and the
planner itself (`plan`: layout, memory per GPU and step time of a recipe on a cluster; the command line's alone).
Free of Megatron, so `make plan` does not import it."""
