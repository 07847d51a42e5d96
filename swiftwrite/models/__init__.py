"""Language models behind one interface (forward.Forward and its declared Abilities): the lean torch model, the
Hugging Face one, llama.cpp's, graphs and tensor-parallel ranks around the lean one; the model store and the
backend chosen by timing both; the thread governor that reads a model's abilities."""
