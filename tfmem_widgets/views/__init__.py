"""Pictures of results: the pool drawn (text, SVG, matplotlib), plots of a trace."""
