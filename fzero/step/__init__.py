"""The pure train step: state, one rank's program, the gradient and the update."""
