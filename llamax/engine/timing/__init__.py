"""What a step costs: the online cost model, the prompt-chunk budget, this machine's
calibration, and the thread policy under contention."""
