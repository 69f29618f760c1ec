"""How a params pytree maps to flat unit buffers, shards and per-parameter segments."""
