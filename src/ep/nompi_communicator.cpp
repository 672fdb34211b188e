// Built without MPI: the MPI factories exist (the API never changes with the build) and throw.
#include "switchyard/dist.h"
#include "switchyard/error.h"

namespace switchyard::dist {

bool mpi_built() { return false; }

std::shared_ptr<Communicator> world() {
  throw BackendError("[dist] world(): switchyard was not built with MPI (SWITCHYARD_MPI=OFF)");
}
std::shared_ptr<Communicator> from_mpi(const void*) {
  throw BackendError("[dist] from_mpi(): switchyard was not built with MPI (SWITCHYARD_MPI=OFF)");
}
std::shared_ptr<Communicator> from_mpi_fortran(int64_t) {
  throw BackendError(
      "[dist] from_mpi_fortran(): switchyard was not built with MPI (SWITCHYARD_MPI=OFF)");
}

}  // namespace switchyard::dist
