"""Running tritonserver: finding it and its Python environment, the process, pid files, launch lines."""
