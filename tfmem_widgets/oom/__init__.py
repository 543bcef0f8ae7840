"""An OOM explained.

TensorFlow's message, the report and its verdict, explaining an error, a dump or a log, the refusals
said while a cell waits, bytes by Keras layer."""
