// The Figure 5 step on MPI: MPI_Allreduce(MAX) of a float array in place, then add 1. Started by
// collective_bench under mpirun; rank 0 prints one line per repeat: "steps_per_s <rate>".
//
//   mpi_allreduce_peer BYTES STEPS REPEATS
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  if (argc != 4) {
    fprintf(stderr, "usage: %s BYTES STEPS REPEATS\n", argv[0]);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  const long count = atol(argv[1]) / 4 > 0 ? atol(argv[1]) / 4 : 1;
  const int steps = atoi(argv[2]), repeats = atoi(argv[3]);
  int rank;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  float* x = calloc((size_t)count, sizeof(float));
  for (int i = 0; i < (steps < 10 ? steps : 10); ++i) {
    MPI_Allreduce(MPI_IN_PLACE, x, (int)count, MPI_FLOAT, MPI_MAX, MPI_COMM_WORLD);
    for (long j = 0; j < count; ++j) x[j] += 1;
  }
  for (int r = 0; r < repeats; ++r) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double start = MPI_Wtime();
    for (int i = 0; i < steps; ++i) {
      MPI_Allreduce(MPI_IN_PLACE, x, (int)count, MPI_FLOAT, MPI_MAX, MPI_COMM_WORLD);
      for (long j = 0; j < count; ++j) x[j] += 1;
    }
    const double rate = steps / (MPI_Wtime() - start);
    if (rank == 0) printf("steps_per_s %.1f\n", rate);
    fflush(stdout);
  }
  free(x);
  MPI_Finalize();
  return 0;
}
