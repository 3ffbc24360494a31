"""The importance matrix: computed over a calibration text as ``llama-imatrix`` does
(``compute``), read and written in llama.cpp's files (``files``)."""
