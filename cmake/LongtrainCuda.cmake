# LONGTRAIN_CUDA=AUTO|ON|OFF. AUTO turns the backend on when nvcc, cuBLASLt, cuDNN (>= 9) and NCCL are
# all found; ON makes any of them missing an error. cuDNN and NCCL may come as Python-wheel layouts
# (site-packages/nvidia/{cudnn,nccl} with only libcudnn.so.9 / libnccl.so.2, no unversioned link):
# point CUDNN_ROOT / NCCL_ROOT at them, or let the search below ask python3 where they are.
set(LONGTRAIN_HAS_CUDA OFF)
if(NOT LONGTRAIN_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  set(_lt_missing "")
  if(NOT CMAKE_CUDA_COMPILER)
    list(APPEND _lt_missing "nvcc")
  else()
    find_package(CUDAToolkit)
    if(NOT TARGET CUDA::cublasLt)
      list(APPEND _lt_missing "cuBLASLt")
    endif()
  endif()

  if(NOT _lt_missing)
    # Wheel roots reported by python3, used only as search hints.
    find_package(Python3 COMPONENTS Interpreter QUIET)
    if(Python3_Interpreter_FOUND)
      execute_process(COMMAND ${Python3_EXECUTABLE} -c "import nvidia.cudnn; print(nvidia.cudnn.__path__[0])"
                      OUTPUT_VARIABLE _lt_cudnn_wheel OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
      execute_process(COMMAND ${Python3_EXECUTABLE} -c "import nvidia.nccl; print(nvidia.nccl.__path__[0])"
                      OUTPUT_VARIABLE _lt_nccl_wheel OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    endif()
    # Installs that put cuDNN and NCCL beside the toolkit (/usr/local/cuda/include, /usr/local/cuda/lib)
    # need no *_ROOT: the toolkit's include and library folders, and their lib/lib64 siblings, are
    # searched after the explicit roots and the wheels.
    set(_lt_toolkit_hints ${CUDAToolkit_INCLUDE_DIRS} ${CUDAToolkit_LIBRARY_DIR})
    foreach(_lt_dir IN LISTS CUDAToolkit_INCLUDE_DIRS CUDAToolkit_LIBRARY_DIR)
      get_filename_component(_lt_parent "${_lt_dir}" DIRECTORY)
      list(APPEND _lt_toolkit_hints "${_lt_parent}")
    endforeach()
    if(CUDAToolkit_LIBRARY_ROOT)
      list(APPEND _lt_toolkit_hints "${CUDAToolkit_LIBRARY_ROOT}")
    endif()
    list(REMOVE_DUPLICATES _lt_toolkit_hints)
    set(_lt_cudnn_hints ${CUDNN_ROOT} $ENV{CUDNN_ROOT} ${_lt_cudnn_wheel} ${_lt_toolkit_hints})
    set(_lt_nccl_hints ${NCCL_ROOT} $ENV{NCCL_ROOT} ${_lt_nccl_wheel} ${_lt_toolkit_hints})
    find_path(CUDNN_INCLUDE_DIR cudnn_graph.h HINTS ${_lt_cudnn_hints} PATH_SUFFIXES include)
    find_library(CUDNN_LIBRARY NAMES cudnn libcudnn.so.9 HINTS ${_lt_cudnn_hints} PATH_SUFFIXES lib lib64)
    find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_lt_nccl_hints} PATH_SUFFIXES include)
    find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_lt_nccl_hints} PATH_SUFFIXES lib lib64)
    if(NOT CUDNN_INCLUDE_DIR OR NOT CUDNN_LIBRARY)
      list(APPEND _lt_missing "cuDNN >= 9 (set CUDNN_ROOT)")
    endif()
    if(NOT NCCL_INCLUDE_DIR OR NOT NCCL_LIBRARY)
      list(APPEND _lt_missing "NCCL (set NCCL_ROOT)")
    endif()
  endif()

  if(_lt_missing)
    if(LONGTRAIN_CUDA STREQUAL "ON")
      message(FATAL_ERROR "LONGTRAIN_CUDA=ON but these were not found: ${_lt_missing}")
    endif()
    message(STATUS "longtrain: CUDA backend off (not found: ${_lt_missing})")
  else()
    set(LONGTRAIN_HAS_CUDA ON)
    enable_language(CUDA)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90)
    endif()
    set(CMAKE_CUDA_STANDARD 20)
    add_library(longtrain_cudnn INTERFACE)
    target_include_directories(longtrain_cudnn INTERFACE ${CUDNN_INCLUDE_DIR})
    target_link_libraries(longtrain_cudnn INTERFACE ${CUDNN_LIBRARY})
    add_library(longtrain_nccl INTERFACE)
    target_include_directories(longtrain_nccl INTERFACE ${NCCL_INCLUDE_DIR})
    target_link_libraries(longtrain_nccl INTERFACE ${NCCL_LIBRARY})
    message(STATUS "longtrain: cuDNN ${CUDNN_LIBRARY}, NCCL ${NCCL_LIBRARY}")
  endif()
endif()

# longtrain_cuda_target(TARGET): settings every target with .cu sources needs.
# - fmt 9 turns its constexpr support off under nvcc, which breaks its C++20 consteval format strings
#   (runtime/error.h); nvcc 13 compiles fmt's constexpr code, so it is turned back on.
# - CMake before 3.26 does not know nvcc's C++20 flag and rejects CUDA_STANDARD 20; there the CUDA
#   sources are compiled as C++17 (they and the runtime headers they include need nothing newer).
function(longtrain_cuda_target target)
  if(NOT DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
    set_target_properties(${target} PROPERTIES CUDA_STANDARD 17)
  endif()
  target_compile_definitions(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:FMT_USE_CONSTEXPR=1>)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-lineinfo>)
  set_target_properties(${target} PROPERTIES POSITION_INDEPENDENT_CODE ON)
endfunction()
