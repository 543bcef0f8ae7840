"""An OOM explained.

The report and its verdict, explaining an error, a dump or a log, the OOM watcher, and the refusals
said while a cell waits."""
