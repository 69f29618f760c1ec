"""The ZeRO transforms and what they plug into a step: sharded units, gathers, offload."""
