"""The workbook's own content, kept apart from the library: the GPU experiments the notebooks
show (run live on a GPU, or as recorded on one), and their recorded results."""
