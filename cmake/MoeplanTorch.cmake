# Finds LibTorch for the executor: LibTorch 2 from the PyTorch wheel that scripts/install-torch
# puts in MOEPLAN_TORCH_HOME. Without it the executor is off, and CMake says how to install it
# (another LibTorch, such as Debian's 1.13, is not looked for: the executor uses LibTorch 2's
# kernels and c10d API).
#
# The wheel's CMake package links its CUDA build (libtorch_cuda) and wants the CUDA toolkit for
# that (12.6 or later; /usr/local/cuda here). The CUDA, cuDNN and NCCL libraries it was built
# against come with it, in site-packages/nvidia: those are searched first when linking and
# loading, so that a toolkit or an NCCL of another version on the machine is never mixed in.

set(MOEPLAN_TORCH_VERSION 2.15.0)
if(NOT "$ENV{MOEPLAN_TORCH_HOME}" STREQUAL "")
  set(MOEPLAN_TORCH_HOME "$ENV{MOEPLAN_TORCH_HOME}" CACHE PATH
      "The virtual environment scripts/install-torch installs LibTorch 2 into" FORCE)
else()
  set(MOEPLAN_TORCH_HOME "$ENV{HOME}/.cache/moeplan/torch-${MOEPLAN_TORCH_VERSION}" CACHE PATH
      "The virtual environment scripts/install-torch installs LibTorch 2 into")
endif()

file(GLOB moeplan_torch_site "${MOEPLAN_TORCH_HOME}/lib/python3*/site-packages")
set(moeplan_torch_root "")
if(moeplan_torch_site AND EXISTS "${moeplan_torch_site}/torch/share/cmake/Torch/TorchConfig.cmake")
  set(moeplan_torch_root "${moeplan_torch_site}/torch")
endif()

if(moeplan_torch_root)
  # The wheel's packages and libraries, also over what an earlier configure found (find_library
  # looks in the system folders before the package's, and would take Debian's libc10).
  set(Torch_DIR "${moeplan_torch_root}/share/cmake/Torch" CACHE PATH "" FORCE)
  set(Caffe2_DIR "${moeplan_torch_root}/share/cmake/Caffe2" CACHE PATH "" FORCE)
  set(c10_LIBRARY "${moeplan_torch_root}/lib/libc10.so" CACHE FILEPATH "" FORCE)
  set(TORCH_LIBRARY "${moeplan_torch_root}/lib/libtorch.so" CACHE FILEPATH "" FORCE)
  if(EXISTS "${moeplan_torch_root}/lib/libc10_cuda.so")
    set(C10_CUDA_LIBRARY "${moeplan_torch_root}/lib/libc10_cuda.so" CACHE FILEPATH "" FORCE)
  endif()
  if(NOT DEFINED CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
    set(TORCH_CUDA_ARCH_LIST "8.0;9.0")  # A100 (p4d), H100 (p5)
  endif()
  # The wheel's Python, with torch: the independent reader of exported checkpoints in the tests
  # and the Python baseline of bench/python run on it.
  set(MOEPLAN_TORCH_PYTHON "${MOEPLAN_TORCH_HOME}/bin/python")
  file(GLOB moeplan_torch_cuda_libs LIST_DIRECTORIES true "${moeplan_torch_site}/nvidia/*/lib")
  foreach(dir IN LISTS moeplan_torch_cuda_libs)
    string(APPEND CMAKE_EXE_LINKER_FLAGS " -Wl,-rpath-link,${dir} -Wl,-rpath,${dir}")
    string(APPEND CMAKE_SHARED_LINKER_FLAGS " -Wl,-rpath-link,${dir} -Wl,-rpath,${dir}")
  endforeach()
else()
  # No wheel: forget whatever an earlier configure took from one.
  get_cmake_property(moeplan_cached CACHE_VARIABLES)
  foreach(var IN LISTS moeplan_cached)
    if(NOT var STREQUAL "MOEPLAN_TORCH_HOME" AND "${${var}}" MATCHES "site-packages/torch")
      unset(${var} CACHE)
    endif()
  endforeach()
  set(Torch_FOUND FALSE)
  set(MOEPLAN_TORCH_MISSING "no LibTorch in ${MOEPLAN_TORCH_HOME}: run scripts/install-torch")
  return()
endif()

find_package(Torch QUIET)
if(NOT Torch_FOUND)
  set(MOEPLAN_TORCH_MISSING "the LibTorch in ${MOEPLAN_TORCH_HOME} did not load: run scripts/install-torch again")
elseif(Torch_VERSION VERSION_LESS 2)
  message(FATAL_ERROR "moeplan: ${MOEPLAN_TORCH_HOME} holds LibTorch ${Torch_VERSION}, not 2 or later")
else()
  message(STATUS "moeplan: LibTorch ${Torch_VERSION} from ${TORCH_INSTALL_PREFIX}")
endif()
