# The generated CUDA kernels load NVRTC with dlopen (elementwise_jit.cu).
if(ONNXCAMPO_CUDA)
  target_link_libraries(onnxcampo_ops PRIVATE ${CMAKE_DL_LIBS})
endif()
