# Finds LibTorch for the executor: LibTorch 2 from the PyTorch wheel that scripts/install-torch
# puts in MOEPLAN_TORCH_HOME, else whatever find_package(Torch) finds (Debian's libtorch-dev).
#
# The wheel's CMake package links its CUDA build (libtorch_cuda) and wants the CUDA toolkit for
# that (12.6 or later; /usr/local/cuda here). The CUDA, cuDNN and NCCL libraries it was built
# against come with it, in site-packages/nvidia: those are searched first when linking and
# loading, so that a toolkit or an NCCL of another version on the machine is never mixed in.

set(MOEPLAN_TORCH_VERSION 2.15.0)
set(MOEPLAN_TORCH_HOME "$ENV{MOEPLAN_TORCH_HOME}" CACHE PATH
    "The virtual environment scripts/install-torch installs LibTorch 2 into")
if(NOT MOEPLAN_TORCH_HOME)
  set(MOEPLAN_TORCH_HOME "$ENV{HOME}/.cache/moeplan/torch-${MOEPLAN_TORCH_VERSION}")
endif()

file(GLOB moeplan_torch_site "${MOEPLAN_TORCH_HOME}/lib/python3*/site-packages")
if(moeplan_torch_site AND EXISTS "${moeplan_torch_site}/torch/share/cmake/Torch/TorchConfig.cmake")
  set(moeplan_torch_root "${moeplan_torch_site}/torch")
  list(PREPEND CMAKE_PREFIX_PATH "${moeplan_torch_root}/share/cmake")
  # The wheel's own libraries, not a system copy of the same name (find_library looks in the
  # system folders before the package's).
  foreach(lib c10 torch torch_cpu torch_cuda c10_cuda)
    if(EXISTS "${moeplan_torch_root}/lib/lib${lib}.so")
      set(${lib}_LIBRARY "${moeplan_torch_root}/lib/lib${lib}.so" CACHE FILEPATH "" FORCE)
    endif()
  endforeach()
  if(NOT DEFINED CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
    set(TORCH_CUDA_ARCH_LIST "8.0;9.0")  # A100 (p4d), H100 (p5)
  endif()
  file(GLOB moeplan_torch_cuda_libs LIST_DIRECTORIES true "${moeplan_torch_site}/nvidia/*/lib")
  foreach(dir IN LISTS moeplan_torch_cuda_libs)
    string(APPEND CMAKE_EXE_LINKER_FLAGS " -Wl,-rpath-link,${dir} -Wl,-rpath,${dir}")
    string(APPEND CMAKE_SHARED_LINKER_FLAGS " -Wl,-rpath-link,${dir} -Wl,-rpath,${dir}")
  endforeach()
endif()

find_package(Torch QUIET)
if(Torch_FOUND)
  message(STATUS "moeplan: LibTorch ${Torch_VERSION} from ${TORCH_INSTALL_PREFIX}")
endif()
