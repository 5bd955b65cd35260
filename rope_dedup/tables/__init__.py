"""RoPE tables read from their content: recognition (is this a RoPE table, and what does it encode) and keys."""
