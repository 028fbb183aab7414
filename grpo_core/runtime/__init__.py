"""Process-level utilities every layer may use: atomic directories, private
scratch directories, which training process this is and what several
processes share, CPU placement, and the one long-lived thread that starts
child servers."""
