"""A job's processes: the command line's options, the launcher, each rank's process and session,
the roles and keys, resuming, and what stops a job (faults, stalls, verdicts)."""
