"""An OOM explained: TensorFlow's message, the report and its verdict, explaining an error, dump or log, bytes by Keras layer."""
