"""Building blocks of the Llama family: tensor-parallel linears, norms, rotary, attention."""
