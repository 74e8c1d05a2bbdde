from minivllm.checkpoint.maker import main

main()
