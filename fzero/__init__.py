"""fzero: ZeRO as pure transforms of a functional train step."""
