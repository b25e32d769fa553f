# The AVX2 kernels are compiled for AVX2 in their own file only; avg_matmul.cc calls them after
# checking the CPU at run time, so the library still loads on x86-64 without AVX2.
if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64|i.86)$")
  set_source_files_properties("${UNIT_DIR}/avg_matmul_avx2.cc" PROPERTIES COMPILE_OPTIONS "-mavx2")
else()
  list(REMOVE_ITEM UNIT_SOURCES "${UNIT_DIR}/avg_matmul_avx2.cc")
endif()
