"""The scheduler and the components it plans a step with (chunks, forks, fair shares,
LoRA turns, CPU decode splits), and the sampling stage of a step."""
