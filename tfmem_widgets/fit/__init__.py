"""What fits and what a fit holds: fresh processes, the batch search, the Keras callback."""
