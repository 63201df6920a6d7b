# One helper to add a library, one to add a test (ns-3 build_lib style).

set(MOEPLAN_WARNING_FLAGS -Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wconversion -Wno-sign-conversion)

# moeplan_unity(<target> [BY_FOLDER])
# With MOEPLAN_UNITY_BUILD, compiles <target>'s files in units of up to 8, or one unit per
# folder of its sources (BY_FOLDER: a part's files share the most). A file with compile options
# of its own is kept out of the units by setting SKIP_UNITY_BUILD_INCLUSION on it.
function(moeplan_unity target)
  if(NOT MOEPLAN_UNITY_BUILD)
    return()
  endif()
  set_target_properties(${target} PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 8)
  if(ARGV1 STREQUAL "BY_FOLDER")
    set_target_properties(${target} PROPERTIES UNITY_BUILD_MODE GROUP)
    get_target_property(sources ${target} SOURCES)
    foreach(source ${sources})
      get_filename_component(folder ${source} DIRECTORY)
      set_property(SOURCE ${source} PROPERTY UNITY_GROUP "${folder}")
    endforeach()
  endif()
endfunction()

# moeplan_add_library(NAME <name> SOURCES ... [PUBLIC_DEPS ...] [PRIVATE_DEPS ...])
# Builds moeplan_<name> from an explicit source list; public headers live in
# <dir>/include/moeplan/<name>/.
function(moeplan_add_library)
  cmake_parse_arguments(ARG "" "NAME" "SOURCES;PUBLIC_DEPS;PRIVATE_DEPS" ${ARGN})
  set(target moeplan_${ARG_NAME})
  add_library(${target} STATIC ${ARG_SOURCES})
  add_library(moeplan::${ARG_NAME} ALIAS ${target})
  target_include_directories(${target} PUBLIC ${CMAKE_CURRENT_SOURCE_DIR}/include
                                       PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/src)
  target_link_libraries(${target} PUBLIC ${ARG_PUBLIC_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  target_compile_options(${target} PRIVATE ${MOEPLAN_WARNING_FLAGS})
  if(MOEPLAN_WARNINGS_AS_ERRORS)
    target_compile_options(${target} PRIVATE -Werror)
  endif()
  moeplan_unity(${target})
endfunction()

# moeplan_test_compile_settings(<target>)
# How a test program's files are compiled: GoogleTest, the tests' support headers, the warning
# flags less -Wconversion, MOEPLAN_TEST_COMPILE_FLAGS and the paths the tests read. One place, so
# that the precompiled test headers (moeplan_reuse_test_pch) are made as their users compile.
function(moeplan_test_compile_settings target)
  target_link_libraries(${target} PRIVATE GTest::gtest)
  target_include_directories(${target} PRIVATE ${PROJECT_SOURCE_DIR}/tests/support)
  target_compile_options(${target} PRIVATE ${MOEPLAN_WARNING_FLAGS} -Wno-conversion ${MOEPLAN_TEST_COMPILE_FLAGS})
  target_compile_definitions(${target} PRIVATE
    MOEPLAN_PROFILE_DIR="${MOEPLAN_PROFILE_DIR}"
    MOEPLAN_TEST_DATA_DIR="${PROJECT_SOURCE_DIR}/tests/data"
    MOEPLAN_BINARY="$<TARGET_FILE:moeplan>")
endfunction()

# moeplan_reuse_test_pch(<target>...)
# Compiles the test programs named with GoogleTest's and the standard library's headers
# precompiled once (target moeplan_test_headers): parsing them is about 2.5 of the 3 to 5 seconds
# a small test file takes at -O0. For the programs that include neither LibTorch (they reuse the
# executor's header, moeplan_reuse_torch_pch) nor Qt (compiled position-independent, which the
# header is not). A file kept at the build type's level (moeplan_tests_at_build_level) predefines
# __OPTIMIZE__, which the header lacks: it is compiled without it. Call from the folder that set
# those files' options.
function(moeplan_reuse_test_pch)
  if(NOT TARGET moeplan_test_headers)
    add_library(moeplan_test_headers STATIC ${PROJECT_SOURCE_DIR}/tests/support/test_headers.cc)
    moeplan_test_compile_settings(moeplan_test_headers)
    target_precompile_headers(moeplan_test_headers PRIVATE
      <gtest/gtest.h> <algorithm> <cmath> <cstdint> <filesystem> <fstream> <functional> <map> <memory>
      <optional> <random> <set> <sstream> <stdexcept> <string> <string_view> <vector>)
  endif()
  foreach(target ${ARGN})
    target_precompile_headers(${target} REUSE_FROM moeplan_test_headers)
    get_target_property(sources ${target} SOURCES)
    foreach(source ${sources})
      get_source_file_property(options ${source} COMPILE_OPTIONS)
      if(options MATCHES "-O")
        set_source_files_properties(${source} TARGET_DIRECTORY ${target} PROPERTIES SKIP_PRECOMPILE_HEADERS ON)
      endif()
    endforeach()
  endforeach()
endfunction()

# moeplan_add_test(NAME <name> SOURCES ... DEPS ... [LABELS fast|slow|viewer] [TIMEOUT s] [SERIAL] [ONE_PROCESS])
function(moeplan_add_test)
  # SERIAL: the tests run alone (ctest starts nothing beside them), for tests that time things.
  # ONE_PROCESS: the program is one ctest test, all its tests in one process, for suites whose
  # tests share what their set-up made once (ctest otherwise starts a process per test).
  cmake_parse_arguments(ARG "SERIAL;ONE_PROCESS" "NAME;TIMEOUT" "SOURCES;DEPS;LABELS" ${ARGN})
  set(target test_${ARG_NAME})
  add_executable(${target} ${ARG_SOURCES})
  target_link_libraries(${target} PRIVATE ${ARG_DEPS} GTest::gtest_main)
  moeplan_test_compile_settings(${target})
  if(NOT ARG_LABELS)
    set(ARG_LABELS fast)
  endif()
  # The programs of each label, for the tier targets (tests/CMakeLists.txt).
  foreach(label ${ARG_LABELS})
    set_property(GLOBAL APPEND PROPERTY MOEPLAN_TESTS_${label} ${target})
  endforeach()
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()
  set(serial FALSE)
  if(ARG_SERIAL)
    set(serial TRUE)
  endif()
  if(ARG_ONE_PROCESS)
    # A whole suite is long: ctest starts it before the single tests (a higher COST first), so
    # that they fill the other cores beside it instead of leaving it alone at the end.
    add_test(NAME ${target} COMMAND ${target})
    set_tests_properties(${target} PROPERTIES LABELS "${ARG_LABELS}" TIMEOUT ${ARG_TIMEOUT} RUN_SERIAL ${serial}
                                              COST 1000)
    return()
  endif()
  # gtest_discover_tests hands a list in PROPERTIES on as separate words: LABELS would keep its
  # first label and the rest of the properties would be lost.
  list(LENGTH ARG_LABELS labels)
  if(labels GREATER 1)
    message(FATAL_ERROR "moeplan_add_test(NAME ${ARG_NAME}): one label for a program whose tests ctest runs one by one")
  endif()
  gtest_discover_tests(${target}
    PROPERTIES LABELS "${ARG_LABELS}" TIMEOUT ${ARG_TIMEOUT} RUN_SERIAL ${serial}
    DISCOVERY_TIMEOUT 60)
endfunction()

# moeplan_tests_at_build_level(<source>...)
# Where MOEPLAN_TEST_COMPILE_FLAGS lowers the test programs' optimisation (every preset), these
# test files keep the build type's level: their tests spend their time in code the file
# instantiates itself (nlohmann's JSON, a fuzz loop, reference tensors), which runs up to three
# times slower at -O0 under ASan. Only the -O option is taken from the build type's flags: its -g
# would come after -g1 and compile full debug information. Sources are named relative to the
# calling directory.
function(moeplan_tests_at_build_level)
  if(NOT MOEPLAN_TEST_COMPILE_FLAGS)
    return()
  endif()
  string(TOUPPER "${CMAKE_BUILD_TYPE}" type)
  separate_arguments(flags UNIX_COMMAND "${CMAKE_CXX_FLAGS_${type}}")
  list(FILTER flags INCLUDE REGEX "^-O")
  set_source_files_properties(${ARGN} PROPERTIES COMPILE_OPTIONS "${flags}")
endfunction()

# moeplan_reuse_torch_pch(<target> [SKIP <source>...])
# Compiles <target>'s files with the executor's precompiled LibTorch headers, except the
# sources named after SKIP (files that do not include LibTorch gain nothing from it). GCC takes
# a precompiled header only where the predefined macros match, and -pedantic takes one away
# (__cpp_runtime_arrays): the target is compiled without it, as the executor is (the lean build
# still compiles the skipped files with it). An optimisation level predefines __OPTIMIZE__: the
# target keeps the executor's, without MOEPLAN_TEST_COMPILE_FLAGS.
function(moeplan_reuse_torch_pch target)
  cmake_parse_arguments(ARG "" "" "SKIP" ${ARGN})
  target_precompile_headers(${target} REUSE_FROM moeplan_executor)
  get_target_property(options ${target} COMPILE_OPTIONS)
  if(options AND MOEPLAN_TEST_COMPILE_FLAGS)
    list(REMOVE_ITEM options ${MOEPLAN_TEST_COMPILE_FLAGS})
    set_target_properties(${target} PROPERTIES COMPILE_OPTIONS "${options}")
  endif()
  target_compile_options(${target} PRIVATE -Wno-pedantic)
  if(ARG_SKIP)
    set_source_files_properties(${ARG_SKIP} TARGET_DIRECTORY ${target} PROPERTIES SKIP_PRECOMPILE_HEADERS ON)
  endif()
endfunction()
