"""The records of past runs: run dirs read back, their pages, two runs compared (`sparkbook runs`, `compare`)."""
