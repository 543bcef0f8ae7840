"""What fits and what a fit holds.

Fresh processes, the batch search and its probes, the Keras callback."""
