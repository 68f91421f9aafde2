# The worker daemon: control client, ActivationService, and the job runtime
# (which links LibTorch through worker/model). Needs DETOUR_WITH_TORCH.
if(NOT DETOUR_WITH_TORCH)
  message(STATUS "DETOUR_WITH_TORCH=OFF: not building detour-worker")
  return()
endif()
add_library(detour_worker_lib STATIC
  ${CMAKE_CURRENT_LIST_DIR}/control_client.cc
  ${CMAKE_CURRENT_LIST_DIR}/worker.cc
)
add_library(detour::worker ALIAS detour_worker_lib)
target_link_libraries(detour_worker_lib
  PUBLIC detour::common detour::net detour::metrics detour::metrics_http detour::metrics_grpc
         detour::transport detour::runtime absl::synchronization absl::time
  PRIVATE detour_warnings)

add_executable(detour-worker ${CMAKE_CURRENT_LIST_DIR}/main.cc)
target_link_libraries(detour-worker PRIVATE detour::worker detour_warnings)
