"""A process's death told: what a dead process left (its signal, TensorFlow's last words on file
descriptor 2, Python's stacks) read into what it means and the fix, and a kernel's record that lets
the next kernel started in the same folder explain it."""
