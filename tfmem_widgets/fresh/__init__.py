"""Code in a new Python process, set up its own way.

The process started, timed and ended with its group, and what crosses to it and back (the job, the
values, how it ended)."""
