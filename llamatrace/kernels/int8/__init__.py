"""The ``q8`` activation mode, llama.cpp's arithmetic: activations quantized to 8 bits a
block (``act8``), the block dot products in LLVM IR (``act8_ir``) and on AMX tiles (``amx``)."""
