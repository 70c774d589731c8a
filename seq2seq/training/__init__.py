"""Training: the loop and its train step, loss, schedules, precision, validation, the run
directory, its metrics log and plots, and the distributed and memory plumbing under them."""
