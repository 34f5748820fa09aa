# Installs the build into a fresh prefix, then configures, builds and runs
# examples/find_package against it: the installed headers, library and
# CMake package are enough for a project of its own.
# cmake -DBUILD_DIR=... -DSOURCE_DIR=... -DWORK_DIR=... -DCXX_COMPILER=... [-DCUDA_ROOT=...] -P check_install.cmake
foreach(variable BUILD_DIR SOURCE_DIR WORK_DIR CXX_COMPILER)
  if(NOT ${variable})
    message(FATAL_ERROR "check_install.cmake needs -D${variable}=...")
  endif()
endforeach()

function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE output)
  message("${output}")
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "${what} failed (${result})")
  endif()
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)
run_step("install" ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix} --component library)
foreach(installed include/tqdecode/decode.hpp bin/tqdecode)
  if(NOT EXISTS ${prefix}/${installed})
    message(FATAL_ERROR "the install has no ${installed}")
  endif()
endforeach()
set(cuda_args)
if(CUDA_ROOT)
  set(cuda_args -DCUDAToolkit_ROOT=${CUDA_ROOT})
endif()
run_step("configure the example" ${CMAKE_COMMAND} -S ${SOURCE_DIR}/examples/find_package -B ${WORK_DIR}/example
         -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_PREFIX_PATH=${prefix}
         ${cuda_args})
run_step("build the example" ${CMAKE_COMMAND} --build ${WORK_DIR}/example)
run_step("run the example" ${WORK_DIR}/example/tqdecode_example)
