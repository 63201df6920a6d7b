// The file the precompiled test headers are made with (moeplan_reuse_test_pch in
// cmake/MoeplanHelpers.cmake); it compiles to nothing.
