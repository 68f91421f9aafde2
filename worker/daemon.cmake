# The worker daemon: control client, ActivationService, and the job runtime
# (which links LibTorch through worker/model). Needs DETOUR_WITH_TORCH, but
# for the control client, which needs no LibTorch and is unit-tested in every
# configuration.
add_library(detour_control_client STATIC ${CMAKE_CURRENT_LIST_DIR}/control_client.cc)
add_library(detour::control_client ALIAS detour_control_client)
target_include_directories(detour_control_client PUBLIC ${PROJECT_SOURCE_DIR})
target_link_libraries(detour_control_client
  PUBLIC detour::proto detour::net gRPC::grpc++ absl::status absl::synchronization absl::time
  PRIVATE detour::common detour_warnings)

if(NOT DETOUR_WITH_TORCH)
  message(STATUS "DETOUR_WITH_TORCH=OFF: not building detour-worker")
  return()
endif()
add_library(detour_worker_lib STATIC ${CMAKE_CURRENT_LIST_DIR}/worker.cc)
add_library(detour::worker ALIAS detour_worker_lib)
target_link_libraries(detour_worker_lib
  PUBLIC detour::common detour::net detour::metrics detour::metrics_http detour::metrics_grpc
         detour::control_client detour::transport detour::runtime absl::synchronization
         absl::time
  PRIVATE detour_warnings)

add_executable(detour-worker ${CMAKE_CURRENT_LIST_DIR}/main.cc)
target_link_libraries(detour-worker PRIVATE detour::worker detour_warnings)
detour_tsan_support(detour-worker)
install(TARGETS detour-worker RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
