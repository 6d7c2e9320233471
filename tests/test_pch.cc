// The source tests/test_pch.h is precompiled for (tests/CMakeLists.txt's tessera_test_pch).
#include "test_pch.h"
