"""Model quality tools: perplexity over a KV format, Oaken calibration, built-in corpora."""
