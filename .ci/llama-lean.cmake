# Included by CMake at the end of llama.cpp's project() call (CMAKE_PROJECT_llama.cpp_INCLUDE in .ci/run), after
# llama-cpp-python has forced LLAMA_BUILD_COMMON on and before llama.cpp reads it: llama.cpp's `common` library and
# the HTTP client it links are 56 % of the binding's build (375 of 674 CPU-seconds on 2 cores, 2026-12-07), and
# nothing swiftwrite or the binding's Python code loads uses them (the binding loads libllama and libggml only).
# The libraries that are built come out with the same machine code (.text) as with common built beside them.
set(LLAMA_BUILD_COMMON OFF CACHE BOOL "llama.cpp: build common utils library" FORCE)
