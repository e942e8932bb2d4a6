"""Pass 4 and 6, memory: activation checkpointing (policies, tags, the partition function, the memory planner), the
offload of saved values to host memory, and reports of what a partition saved."""
