"""Layer 2, processes: start ranks (launch), know who you are (env), run launcher commands (commands), save and resume (checkpoint)."""
