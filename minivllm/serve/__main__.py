from minivllm.serve.cli import main

main()
